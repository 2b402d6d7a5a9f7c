"""ViT: the ViT-style vision layer (policies/shapes.py VisionShape): attention
heads and MLP features split over the tensor-parallel group.

    layers.*.attention.{q,k,v}_proj   Linear1D_Col  (per head: rank i computes its heads H_i)
    layers.*.attention.o_proj         Linear1D_Row  (input split by the same heads; all-reduce
                                                     forward, identity backward)
    layers.*.mlp.fc1                  Linear1D_Col
    layers.*.mlp.fc2                  Linear1D_Row
    layers.*.dropout                  DropoutForReplicatedInput
    classifier                        Linear1D_Col, gathered (any label count; none with
                                      num_labels=0, where HF's classifier is an nn.Identity)

Patch embeddings, layer norms, the pooler and the masked-image-modeling
decoder (a 1x1 convolution) stay replicated.  ViTAttention infers its head
count from the projection width, so no attribute changes per rank.

Split-gather sequence parallelism: VisionShape's (the patch tokens split along
the sequence between the first and the last layer; o_proj and fc2
reduce-scatter and add their bias on this rank's rows; the layer's dropout
draws a mask per rank; the layer norms' gradients all-reduced).
"""
from shardformer.family import Family, gathered
from shardformer.policies.shapes import VisionShape

FAMILY = Family("vit", "vit.modeling_vit", VisionShape, options={"prefix": "ViT"}, heads={
    "ViTModel": (),
    "ViTForImageClassification": gathered("classifier"),
    "ViTForMaskedImageModeling": (),
})
globals().update(FAMILY.policy_classes())
