"""Splitting a model into pipeline stages, and running one stage of it.

The split is data on the policy (`FamilyPolicy.pipeline_split`, a StageSplit):
the module that runs the layers (`owner`), the path of its layer list under
it, and which of its other children run after the layers (the final norm,
a pooler).  From that, every parameter-holding module of the model falls in
one of three places:

    layers      module `layers.i`: held by the virtual stage whose range holds i
    first       a child of the owner (or of an ancestor of the layer list) that
                runs before the layers (embeddings): the first virtual stage
    last        the owner's children named in `last`, and every module outside
                the owner (the heads): the last virtual stage

Modules without parameters (rotary embeddings, dropouts) stay on every stage.

Repeated calls (StageSplit.calls: ALBERT).  Some encoders call the modules of
their layer list several times in one forward: N calls over G modules, call
i running module i*G//N (consecutive blocks of N/G calls per module).  Then
the stages split the N *calls*, not the G modules: a virtual stage holding
calls a..b holds the modules those calls run, so a module whose calls fall
on several stages is replicated on each of them.  The layer list becomes a
StageCalls: indexing it gives a slot that numbers the calls of one forward;
a call outside the running chunk returns its hidden states unchanged (the
stand-in before the chunk), the chunk's first call swaps in the received
activation and its last ends the forward, as for distinct layers.  Each
replica's gradient holds its own stage's calls only; after backward the
schedule sums it over the stages that hold the module (PipelineSchedule.
_sum_over_holders, the one mechanism for every parameter held by several
stages: tied sets too), so every replica steps with the unsharded model's
gradient.

Modules on every stage (StageSplit.everywhere: BEiT's shared relative
position bias).  A child of the owner whose output every layer reads is
replicated on all stages and run by each; its gradients are summed over the
stages in the same way.

A stage does not get a forward of its own: every stage runs the model's own
HuggingFace forward, with the tensors redirected (StageRuntime):

  * the layer list becomes a StageLayers: it holds this rank's layers under
    their global indices (so state_dict names are the unsharded model's) and
    iterates over the layers of the chunk being run only;
  * on a stage that does not hold them, the first-stage modules return zeros
    shaped like the activation received from the previous stage, and the
    first layer of the chunk is called with that activation instead; the
    last-stage modules are absent (StageAbsent: calling one raises, naming
    the stage that holds it);
  * the last layer of a chunk that is not the chain's last ends the forward
    (StageExit, carrying its output), so nothing after it runs.

A forward that loops over a layer count instead of the list (StageSplit.count:
ChatGLM2's `for i in range(self.num_layers): self.layers[i]`) sees the
count set to the running chunk's, n, and index i of the list (0 <= i < n)
is the chunk's i-th layer; the count is the model's again after the forward.

Both are done by what StageLayers yields, not by hooks on the layers: the
first and last layer of a chunk come wrapped in a _ChunkEdge, which swaps
the hidden states before calling the layer and raises after it.  So a layer
that recomputes its forward (gradient checkpointing) recomputes it from the
received activation, as it ran.

The masks, position ids and rotary tables are computed by the model's own
forward on every stage from the micro-batch, which every stage is given.

Two stacks (an encoder-decoder; StageSplit.then, a StageStack): the stages
split the concatenated list [first stack's layers | second stack's layers],
E + D layers.  The first stack's `last` modules (its final norm) are held
by the virtual stage of layer E - 1, the second stack's `first` modules
(its embeddings) by that of layer E, its `last` ones (final norm, heads) by
the last.  Messages are tuples of tensors (StageRuntime): what a layer hands
the next besides its hidden states (`carry`, T5's position biases) travels
with them, and inside the second stack so does the first stack's output.
A chunk that ends with the first stack ends at the stack module's output (a
forward hook), one that starts in the second stack does not run the first
(the received output goes in as the model's `skip` keyword).  A Parameter
held by modules on several stages (a shared embedding) is one tied set,
its gradient summed over them.

Hidden states read after the layers (StageSplit.reads: BEiT's segmentation
head reads the hidden states of its out_indices layers).  Hidden state k is
the input of layer k (k = the layer count: the last layer's output), HF's
output_hidden_states numbering.  Each one read is recorded where it is
computed (a forward pre-hook on layer k) and travels on to the last stage in
every message after it, as extra tensors: a message leaving a chunk that
ends before layer e is (hidden states, hidden state k for each read k < e),
in increasing k.  Its gradient comes back with the message's, the sender's
backward adding it to that of the layers it fed.  On the last stage the
owner's output (HF's output.hidden_states, captured for the layers that
stage ran) is rebuilt to the whole model's numbering: entry k is the
received tensor where k is read before the stage's first layer, the stage's
own capture from there on, None for an entry no stage sends (nothing reads
it).

Sequence parallelism inside the stages (every SP mode; each stack splits
on its own, at its first layer, and gathers after its last): a message's
hidden states are this rank's rows of the stack's padded sequence, split
on the stage holding the stack's first layer; a chunk that enters a stack
past that layer tells that stack's states (stack_states) the full length,
read off the stand-ins' output (shaped like the first stage's layer input,
which travels in the message header).  The other parts travel whole, as
every rank of the SP group holds them:

  * T5's position biases, built in the stack's first layer for the whole
    (padded) sequence: every head on every rank under all_to_all /
    ring_attn, this rank's TP heads under split_gather.  Each rank's use
    of them gives its part of their gradient, which goes back with the
    message to the bias table; the group sums the table's gradient.
  * the first stack's output, gathered after the first stack: the message
    at the stack boundary and the last part of every second-stack message.
    Each rank's cross-attention rows give a partial gradient of it, summed
    over the group where the second stack reads it (sequence_attention's
    wrapper, or split_gather's TP column layers); the message carries the
    output as received, not the wrapper (_source_sent), so the gradient
    coming back from later stages, summed there already, is not summed
    again.  Whole rather than split: every decoder stage needs all of it
    (its keys and values), so a split message would cost an all-gather per
    micro-batch on every such stage; whole, it is gathered once.
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
from dataclasses import dataclass

import torch
from torch import nn
from ..layer.sequence_attention import unsummed

__all__ = ["StageSplit", "StageStack", "StagePlan", "StageLayers", "StageCalls", "StageAbsent", "StageExit",
           "StageRuntime",
           "plan_stages", "runtime_of"]

RUNTIME = "_shardformer_pipeline"
# Layers a forward looping over a layer count got by their chunk position (StageSplit.count; for tests).
# StageSplit.shaped_layers: layers run in shapes only before a chunk (for tests).
COUNTS = {"chunk_positions": 0, "shaped_layers": 0}


@dataclass(frozen=True)
class StageStack:
    """A second layer list that runs after the first one (an encoder-decoder's
    decoder), as data; see StageSplit.then.

    layers  dotted path of its layer ModuleList under the owner ("decoder.block")
    first   children (paths under the owner) that run before its layers (its
            embeddings): held by the virtual stage of its first layer
    last    children that run after its layers (its final norm, the heads
            inside the owner): held by the last virtual stage
    carry   (layer argument, output index) pairs: what one of its layers hands
            the next besides the hidden states (T5's position biases)
    source  the layer argument holding the first stack's output ("encoder_hidden_states")
    skip    the model's forward keyword that takes the first stack's output
            instead of running the first stack ("encoder_outputs")"""

    layers: str
    first: tuple[str, ...] = ()
    last: tuple[str, ...] = ()
    carry: tuple[tuple[str, int], ...] = ()
    source: str = ""
    skip: str = ""


@dataclass(frozen=True)
class StageSplit:
    """Where a model's pipeline stages split, as data.

    owner   class name of the module whose forward runs the layers ("LlamaModel");
            "{prefix}" and "{base_model}" are filled from the policy's options
    layers  dotted path of the layer ModuleList under the owner ("layers", "encoder.layer")
    last    children of the owner that run after the layers ("norm", "pooler"); with
            `then`, after the first stack's layers (held by the stage of its last layer)
    carry   (layer argument, output index) pairs a layer hands the next besides the
            hidden states (T5's position bias); they travel with the activation
    then    a second stack (StageStack): the stages split the concatenated layer
            list [layers | then.layers]
    shaped  first-stage modules (paths under the owner) whose stand-in is zeros
            shaped like their own output (worked out on their meta copy), not like
            the layers' input: a front end whose output is reshaped before the
            layers (Whisper's convolutions)
    calls   None: the forward calls each module of the layer list once, in order.
            Else the config attribute counting the calls the forward makes of the
            list's modules ("num_hidden_layers" for ALBERT's layer groups): call i
            runs module i*G//N of the G modules (N calls, N a multiple of G); the
            stages split the calls, and a module called on several stages is
            replicated on them (see the module docstring); one stack only (no `then`)
    everywhere  children (or Parameters) of the owner, or else of the model, whose
            output every stage's forward reads (BEiT's shared relative position
            bias, computed before the layers and passed to all of them; SAM's
            absolute positions added to the stand-in embeddings and its image-wide
            positional embedding, computed before the vision encoder): replicated
            on every stage, each running it itself;
            their gradients are summed over the stages like a replicated module's
            (a name the model lacks is skipped)
    count   "": the forward iterates over the layer list (or slices it).  Else the
            attribute of the module holding the list ("num_layers"; dotted:
            "config.num_hidden_layers", the BLIP-2 Q-Former's) that its forward
            loops over, `for i in range(self.count): self.layers[i]`: while a chunk
            runs, the stage sets it to the chunk's layer count n and indexing the
            list with i in 0..n-1 gives the chunk's i-th layer (global index
            chunk start + i); afterwards the attribute is the model's again; one
            stack only (no `then`, no `calls`)
    reads   indices k of the stack's hidden states (the input of layer k; the layer
            count: the last layer's output) that the forward reads after the layers
            (BEiT segmentation's out_indices): they travel to the last stage in the
            messages, where the owner's output.hidden_states holds them at their
            indices (see the module docstring); one stack only (no `then`, `calls`)
    shaped_layers  False: the forward hands each layer the previous one's hidden
            states and nothing else that a layer changes.  True: it also carries state
            from layer to layer that it works out from what each layer returns (Swin's
            stage loop halves input_dimensions after each patch merging, and a stage's
            input is [batch, H*W, C] at that stage's resolution).  Then the layers
            before the running chunk are not skipped: the forward gets each as a
            stand-in that runs the layer's meta copy (made before tensor parallelism
            replaces anything: shapes only, no compute, no communication) and returns
            zeros shaped like the layer's output, with its non-tensor outputs as
            computed; so the chunk's first layer is called with the unsharded
            forward's state, and its computed input has the received message's shape.
            The messages change shape at each stage edge (each edge has its own
            header).  One stack only (no `then`, `calls`, `count`)
    batch_dims  (output field, dimension) pairs: outputs of the model whose batch
            dimension is not 0 (ChatGLM2's last_hidden_state, [seq, batch, hidden]:
            ("last_hidden_state", 1)); the schedules concatenate the micro-batches'
            outputs along it"""

    owner: str
    layers: str
    last: tuple[str, ...] = ()
    carry: tuple[tuple[str, int], ...] = ()
    then: StageStack | None = None
    shaped: tuple[str, ...] = ()
    calls: str | None = None
    everywhere: tuple[str, ...] = ()
    count: str = ""
    batch_dims: tuple[tuple[str, int], ...] = ()
    reads: tuple[int, ...] = ()
    shaped_layers: bool = False


class StageExit(BaseException):
    """Raised by the last layer of a chunk that is not the chain's last: ends
    the model's forward there, carrying the layer's output (a BaseException,
    so that no `except Exception` in model code swallows it)."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__("pipeline stage output")
        self.hidden = hidden


class StageAbsent(nn.Module):
    """Stands in for a module another stage holds.  A first-stage module
    (role "first") returns zeros shaped like the activation this stage
    receives (the first layer replaces them by that activation); a
    last-stage module (role "last") raises when called.  Attributes the
    model's forward reads off the module (ViT asks its patch embedding's
    weight for its dtype) come from a copy of the module on the meta device
    (shapes and dtypes, no storage), kept out of the module tree."""

    def __init__(self, path: str, role: str, holder: int, runtime: "StageRuntime", original: nn.Module):
        super().__init__()
        self.path, self.role, self.holder = path, role, holder
        self.__dict__["_runtime"] = runtime          # not a sub-module, not in state_dict
        self.__dict__["_shadow"] = _meta_shadow(original)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            shadow = self.__dict__.get("_shadow")
            if shadow is None or name.startswith("__"):
                raise
            return getattr(shadow, name)

    def extra_repr(self) -> str:
        return f"{self.path!r}, {self.role}, held by stage {self.holder}"

    def forward(self, *args, **kwargs):
        if self.role == "first":
            if self.path in self._runtime.plan.shaped:
                return self._runtime.shaped_stand_in(self.__dict__["_shadow"], args, kwargs)
            return self._runtime.stand_in()
        raise RuntimeError(f"{self._runtime.model_name}: {self.path} is held by pipeline stage {self.holder}; "
                           f"this is stage {self._runtime.manager.stage}")


class StageLayers(nn.ModuleList):
    """A layer list holding this rank's layers under their global indices.
    Iterating (or slicing) yields the layers of the chunk being run only;
    len() is the whole model's layer count; indexing a layer another stage
    holds raises IndexError naming it."""

    def __init__(self, layers: dict[int, nn.Module], total: int, chunks: list[range], path: str):
        nn.Module.__init__(self)
        for i, layer in layers.items():
            self.add_module(str(i), layer)
        self._total, self._chunks, self._path = total, chunks, path
        self.active: int | None = None               # the chunk being run

    def extra_repr(self) -> str:
        return f"{self._total} layers, held: {_spans(self._chunks)}"

    def begin(self) -> None:
        """A forward of the model starts (StageRuntime.run)."""

    def _running(self) -> range:
        if self.active is None:
            raise RuntimeError(f"{self._path}: the layers of a pipeline stage run inside a schedule "
                               f"(shardformer.pipeline)")
        return self._chunks[self.active]

    def __len__(self) -> int:
        return self._total

    def _yielded(self, i: int):
        layer = self._modules[str(i)]
        edges = self.__dict__.get("_edges", {}).get(self.active, {})
        enter, leave = edges.get("enter") == i, edges.get("exit") == i
        return _ChunkEdge(layer, self.__dict__["_runtime"], enter, leave, self.__dict__.get("_spec"), i) \
            if enter or leave else layer

    def _before(self) -> list:
        """StageSplit.shaped_layers: the layers before the running chunk, as
        _ShapedLayer stand-ins (none without it)."""
        shadows = self.__dict__.get("_shadows")
        if not shadows:
            return []
        return [_ShapedLayer(shadows[i], i) for i in range(self._running().start)]

    def __iter__(self):
        return iter(self._before() + [self._yielded(i) for i in self._running()])

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            wanted = set(range(self._total)[idx])
            return [s for s in self._before() if s._index in wanted] + \
                [self._yielded(i) for i in self._running() if i in wanted]
        if self.__dict__.get("_positional") and self.active is not None:
            return self._chunk_position(idx)
        i = idx + self._total if isinstance(idx, int) and idx < 0 else idx
        key = str(i)
        if key not in self._modules:
            raise IndexError(f"{self._path}[{idx}]: layer {i} is not held by this pipeline stage (it holds "
                             f"{_spans(self._chunks)})")
        return self._modules[key]

    def _chunk_position(self, idx):
        """Layer `idx` of the running chunk, for a forward that loops over a
        layer count the stage set to the chunk's (StageSplit.count): the
        layer of global index chunk start + idx."""
        running = self._running()
        if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < len(running):
            raise IndexError(f"{self._path}[{idx!r}]: pipeline chunk {self.active} runs {len(running)} layers "
                             f"({', '.join(_spans([running]))}), indexed 0..{len(running) - 1} by its forward")
        COUNTS["chunk_positions"] += 1
        return self._yielded(running.start + idx)


def _spans(chunks: list[range]) -> list[str]:
    return [f"{r.start}-{r.stop - 1}" for r in chunks if len(r)]


class StageCalls(StageLayers):
    """The layer list of a model that calls its modules repeatedly
    (StageSplit.calls): holds the modules this rank's calls run, under their
    indices in the list (state_dict names are the unsharded model's).
    `call_module[i]` is the module call i runs.  Indexing returns a _CallSlot,
    which numbers the calls of one forward (begin() restarts the count) and
    runs only those of the running chunk; len() is the module count."""

    def __init__(self, modules: dict[int, nn.Module], call_module: tuple[int, ...], chunks: list[range], path: str):
        super().__init__(modules, len(call_module), chunks, path)
        self._call_module = call_module
        self._num_modules = max(call_module) + 1
        self.calls_made = 0                           # calls in the current forward

    def extra_repr(self) -> str:
        held = sorted(int(k) for k in self._modules)
        return (f"{self._num_modules} modules called {self._total} times; held: modules {held} for calls "
                f"{_spans(self._chunks)}")

    def begin(self) -> None:
        self.calls_made = 0

    def __len__(self) -> int:
        return self._num_modules

    def __iter__(self):
        return iter([self._modules[k] for k in sorted(self._modules, key=int)])

    def __getitem__(self, idx):
        if not isinstance(idx, int):
            raise TypeError(f"{self._path}: a pipelined list of repeatedly called modules is indexed by one module "
                            f"index, got {idx!r}")
        i = idx + self._num_modules if idx < 0 else idx
        if not 0 <= i < self._num_modules:
            raise IndexError(f"{self._path}[{idx}]: the list has {self._num_modules} modules")
        return _CallSlot(self, i)

    def next_call(self, module: int) -> int:
        """Number the next call (of `module`); RuntimeError when the forward
        calls another module, or more often, than the split planned."""
        i = self.calls_made
        if i >= self._total or self._call_module[i] != module:
            planned = self._call_module[i] if i < self._total else "none"
            raise RuntimeError(f"{self._path}: call {i} of the forward ran module {module}; the pipeline split "
                               f"planned module {planned} ({self._total} calls of {self._num_modules} modules)")
        self.calls_made += 1
        return i


class _CallSlot:
    """Module `module` of a StageCalls, as the model's forward gets it by
    indexing: calling it is one numbered call.  Outside the running chunk the
    call returns its hidden states (first positional argument or
    hidden_states=) unchanged and runs nothing; the chunk's first and last
    calls are the chunk's edges (_ChunkEdge)."""

    def __init__(self, calls: StageCalls, module: int):
        self.calls, self.module = calls, module

    def __getattr__(self, name: str):
        held = self.calls._modules.get(str(self.module))
        if held is None:
            raise AttributeError(f"{self.calls._path}[{self.module}] is not held by this pipeline stage")
        return getattr(held, name)

    def __call__(self, *args, **kwargs):
        calls = self.calls
        i = calls.next_call(self.module)
        running = calls._running()
        if i not in running:
            return args[0] if args else kwargs["hidden_states"]
        layer = calls._modules[str(self.module)]
        edges = calls.__dict__.get("_edges", {}).get(calls.active, {})
        enter, leave = edges.get("enter") == i, edges.get("exit") == i
        if enter or leave:
            return _ChunkEdge(layer, calls.__dict__["_runtime"], enter, leave, calls.__dict__.get("_spec"),
                              i)(*args, **kwargs)
        return layer(*args, **kwargs)


class _ChunkEdge:
    """The first and / or last layer of the running chunk, as the model's
    forward sees it: called, it runs the layer on the received activation
    (enter) and ends the forward with the layer's output (leave).  Every
    attribute is the layer's."""

    def __init__(self, layer: nn.Module, runtime: "StageRuntime", enter: bool, leave: bool,
                 spec: "_StackSpec | None" = None, index: int = -1):
        self.__dict__.update(_layer=layer, _runtime=runtime, _enter=enter, _leave=leave, _spec=spec, _index=index)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["_layer"], name)

    def __call__(self, *args, **kwargs):
        rt = self._runtime
        if rt.messages_are_tuples:
            return self._call_with_tuples(rt, args, kwargs)
        if self._enter:
            if args:
                computed, swap = args[0], (lambda t: ((t,) + tuple(args[1:]), kwargs))
            elif "hidden_states" in kwargs:
                computed, swap = kwargs["hidden_states"], (lambda t: (args, dict(kwargs, hidden_states=t)))
            else:
                raise RuntimeError(f"{rt.model_name}: the first layer of pipeline chunk {rt.chunk} was called "
                                   f"without its hidden states (no positional argument, no hidden_states=)")
            if rt.entry is None:                   # the first virtual stage: the model's own input
                rt.input_shape = rt.unsplit_shape(computed)
            else:
                rt.entered = True
                args, kwargs = swap(rt.entry)
                # Sequence parallelism: the received rows are already split (on the first stage);
                # the stand-in carried the full length here, which the states learn.
                for state in rt.sequence_states:
                    state.resume(computed)
        out = self._layer(*args, **kwargs)
        if self._leave:
            raise StageExit(out if isinstance(out, torch.Tensor) else out[0])
        return out

    def _call_with_tuples(self, rt: "StageRuntime", args, kwargs):
        """The same with messages of several tensors (a split with carry or two
        stacks): entering, the received hidden states and carried arguments
        replace the computed ones (a chunk that starts a stack keeps its own and
        only records their shape); leaving, the message is (hidden states,
        carried outputs..., the first stack's output when in the second)."""
        params = inspect.signature(self._layer.forward).parameters
        bound = inspect.signature(self._layer.forward).bind(*args, **kwargs)
        hidden_name = next(iter(params))
        spec, index = self._spec, self._index + self._spec.start       # index: in the concatenated list
        if self._enter:
            computed = bound.arguments[hidden_name]
            if index == rt.chunk_range().start:
                rt.entered = True
            if index == rt.chunk_range().start and rt.swaps_entry():
                bound.arguments[hidden_name] = rt.entry[0]
                for k, (arg, _) in enumerate(spec.carry):
                    if arg not in params:
                        raise RuntimeError(f"{rt.model_name}: {type(self._layer).__name__} takes no argument "
                                           f"{arg!r} (pipeline split carry)")
                    bound.arguments[arg] = rt.entry[1 + k]
                rt.receive_reads(len(spec.carry))
                # Sequence parallelism: the received hidden states are this rank's rows (split on the
                # stack's first stage); `computed`, from the stand-ins, has the stack's full length
                for state in rt.states_of(spec):
                    state.resume(computed)
            else:                                  # a stack starts here: its input shape, for the stand-ins
                rt.input_shape = tuple(computed.shape)
        out = self._layer(*bound.args, **bound.kwargs)
        if self._leave:
            parts = (out if isinstance(out, torch.Tensor) else out[0],)
            parts += tuple(out[i] for _, i in spec.carry)
            if spec.source:
                parts += (_source_sent(bound.arguments.get(spec.source)),)
            parts += rt.reads_sent(index + 1)
            if any(not isinstance(t, torch.Tensor) for t in parts):
                raise RuntimeError(f"{rt.model_name}: pipeline chunk {rt.chunk} ends at layer {index} with "
                                   f"a message part that is not a tensor ({[type(t).__name__ for t in parts]})")
            raise StageExit(parts)
        return out


def _source_sent(source):
    """The first stack's output as the message carries it on: the tensor
    the stack received, not the identity whose backward all-reduces over the
    sequence-parallel group (all_to_all / ring_attn wrap it on entering the
    stack, sequence_attention.unsummed).  The next stage sends back the
    gradient of its own uses already summed over the group, which must not
    be summed again; this stage's uses reach the wrapper and are summed once."""
    return unsummed(source) if isinstance(source, torch.Tensor) else source


@dataclass(frozen=True)
class _StackSpec:
    """One layer list of the split, as the runtime sees it: where it sits in the
    concatenated layer list, and what its messages carry (StageSplit / StageStack)."""

    path: str                          # full dotted path of the layer list
    module: str                        # full dotted path of the module holding it
    start: int                         # its first layer's index in the concatenated list
    stop: int
    carry: tuple[tuple[str, int], ...] = ()
    source: str = ""
    skip: str = ""


@dataclass
class StagePlan:
    """The checked split of one model for this rank (plan_stages); nothing changed yet."""

    owner_path: str
    layers_path: str                  # full dotted path of the (first) layer list
    total: int                        # layers of all stacks
    chunks: list[range]               # this rank's layers, per chunk (concatenated indices)
    placed: list[tuple[str, str, int]]  # (module path, "first" | "last", holding virtual stage)
    shared: list[tuple[str, ...]]     # paths (path.param) of one Parameter held by different stages
    names: list[str]                  # the unsharded model's state_dict keys
    stacks: list[_StackSpec]          # one per layer list, in order
    counts: list[int]                 # layers per virtual stage
    shaped: tuple[str, ...] = ()      # full paths of the first-stage modules with shaped stand-ins
    call_module: tuple[int, ...] | None = None     # StageSplit.calls: the module of each call
    holders: dict[int, tuple[int, ...]] | None = None  # StageSplit.calls: module -> the stages holding it
    everywhere: list[str] = dataclasses.field(default_factory=list)  # StageSplit.everywhere, with parameters
    count: str = ""                   # StageSplit.count: the attribute the forward loops over
    batch_dims: dict[str, int] = dataclasses.field(default_factory=dict)  # StageSplit.batch_dims
    reads: tuple[int, ...] = ()       # StageSplit.reads, checked and sorted
    # StageSplit.shaped_layers: a hook-free meta copy of every layer, made before any TP swap
    layer_shadows: list = dataclasses.field(default_factory=list)

    @property
    def tuples(self) -> bool:
        """Whether the messages between stages are tuples of tensors (carry, two stacks, reads)."""
        return len(self.stacks) > 1 or bool(self.stacks[0].carry) or bool(self.reads)

    def reads_before(self, layer: int) -> list[int]:
        """The read hidden states a message into `layer` carries (k < layer)."""
        return [k for k in self.reads if k < layer]

    def virtual_stage_of(self, layer: int) -> int:
        """The virtual stage running `layer` (an index in the concatenated list)."""
        end = 0
        for vs, n in enumerate(self.counts):
            end += n
            if layer < end:
                return vs
        raise IndexError(layer)


def _meta_shadow(module: nn.Module) -> nn.Module:
    """A copy of `module`'s tree whose parameters and buffers are meta
    tensors of the same shapes and dtypes (the original is left as it is:
    a parameter it shares with a module this stage keeps stays real)."""
    shadow = copy.copy(module)
    shadow.__dict__ = dict(module.__dict__)
    shadow._parameters = {n: None if p is None else nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
                          for n, p in module._parameters.items()}
    shadow._buffers = {n: None if b is None else torch.empty_like(b, device="meta")
                       for n, b in module._buffers.items()}
    shadow._modules = {n: None if c is None else _meta_shadow(c) for n, c in module._modules.items()}
    return shadow


def _without_hooks(shadow: nn.Module) -> nn.Module:
    """`shadow` (a _meta_shadow) with no forward hooks anywhere in its tree:
    the hook dicts it shares with the real modules (HF's output recorders,
    shardformer's own) are for real activations, not shapes."""
    from collections import OrderedDict

    for m in shadow.modules():
        for attr in ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                     "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs"):
            if attr in m.__dict__:
                m.__dict__[attr] = OrderedDict()
    return shadow


def _map_tensors(fn, x):
    """`x` with fn applied to every tensor in it (through tuples, lists and dicts)."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (tuple, list)):
        out = [_map_tensors(fn, v) for v in x]
        return type(x)(*out) if hasattr(x, "_fields") else type(x)(out)
    if isinstance(x, dict):
        out = copy.copy(x)
        for k, v in x.items():
            out[k] = _map_tensors(fn, v)
        return out
    return x


def shape_run(shadow: nn.Module, args, kwargs):
    """What a module would return on (args, kwargs), in shapes only: its meta
    copy `shadow` runs on the arguments' meta images (no compute, no
    communication), and every tensor of the output becomes zeros of its shape
    and dtype on the arguments' device; non-tensor outputs (Swin's
    (height, width)) are as computed."""
    found = []
    _map_tensors(found.append, (args, kwargs))
    device = found[0].device if found else torch.device("cpu")
    meta = (lambda t: t.detach().to("meta"))
    with torch.no_grad():
        out = shadow(*_map_tensors(meta, args), **_map_tensors(meta, kwargs))
    return _map_tensors(lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device), out)


class _ShapedLayer:
    """Layer `index`, before the running chunk, as the forward of a
    StageSplit.shaped_layers model gets it: calling it gives zeros shaped
    like the layer's output (shape_run on its meta copy); every attribute is
    the meta copy's (Swin's encoder asks a stage for its `downsample`)."""

    def __init__(self, shadow: nn.Module, index: int):
        self.__dict__.update(_shadow=shadow, _index=index)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["_shadow"], name)

    def __call__(self, *args, **kwargs):
        COUNTS["shaped_layers"] += 1
        return shape_run(self.__dict__["_shadow"], args, kwargs)


def _child_paths(module: nn.Module, prefix: str):
    for name, child in module.named_children():
        yield (f"{prefix}.{name}" if prefix else name), child


def _has_params(module: nn.Module) -> bool:
    if isinstance(module, nn.Parameter):
        return True
    return any(True for _ in module.parameters())


def _layer_list(model: nn.Module, path: str, owner_cls: str, rel: str, name: str) -> nn.ModuleList:
    try:
        layers = model.get_submodule(path)
    except AttributeError:
        raise ValueError(f"{name}: {owner_cls} has no layer list {rel!r} for pipeline parallelism") from None
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{name}: {path} is a {type(layers).__name__}, expected the ModuleList of layers")
    return layers


def plan_stages(model: nn.Module, split: StageSplit, manager, name: str, prefix: str = "",
                base_model: str = "") -> StagePlan:
    """Check `split` against `model` and work out this rank's part (ValueError
    naming the model and module when it does not fit); changes nothing.
    With split.then the stages split the concatenated list [first stack's
    layers | second stack's layers]."""
    owner_cls = split.owner.format(prefix=prefix, base_model=base_model)
    owners = [(path, m) for path, m in model.named_modules() if type(m).__name__ == owner_cls]
    if len(owners) != 1:
        raise ValueError(f"{name}: pipeline parallelism splits the layers of one {owner_cls} module; "
                         f"found {len(owners)}")
    owner_path, owner = owners[0]
    join = (lambda a, b: f"{a}.{b}" if a else b)
    parts = [(split.layers, split.carry, "", "")]
    if split.then is not None:
        parts.append((split.then.layers, split.then.carry, split.then.source, split.then.skip))
    if split.calls is not None and split.then is not None:
        raise ValueError(f"{name}: a pipeline split of repeated calls (calls={split.calls!r}) takes one layer "
                         f"list, not a second stack")
    stacks, lists, start = [], [], 0
    call_module = holders = None
    for rel, carry, source, skip in parts:
        path = join(owner_path, rel)
        layers = _layer_list(model, path, owner_cls, rel, name)
        size = len(layers)
        if split.calls is not None:                  # the stages split the calls, not the modules
            call_module = _call_modules(model, split.calls, len(layers), name, path)
            size = len(call_module)
        stacks.append(_StackSpec(path, path.rpartition(".")[0], start, start + size, tuple(carry),
                                 source, skip))
        lists.append(layers)
        start += size
    total = start
    where_layers = " + ".join(st.path for st in stacks)
    skip_kw = stacks[-1].skip
    if len(stacks) > 1 and skip_kw not in inspect.signature(type(model).forward).parameters:
        raise ValueError(f"{name}: pipeline stages past {stacks[0].path} pass its output as {skip_kw}=, which "
                         f"{type(model).__name__}.forward does not take")
    counts = manager.distribute_layers(total, f"{name}: {where_layers}")
    chunks = manager.layer_ranges(total, f"{name}: {where_layers}")
    if call_module is not None:
        holders = _module_holders(manager, call_module, f"{name}: {where_layers}")
    everywhere = _everywhere_paths(model, owner_path, split.everywhere)
    for path, m in ((owner_path, owner), ("", model)):        # a Parameter replicated everywhere may be direct
        direct = [n for n, _ in m.named_parameters(recurse=False) if join(path, n) not in everywhere]
        if direct:
            raise ValueError(f"{name}: {path or type(model).__name__} holds parameters {direct} directly; "
                             f"pipeline parallelism places whole sub-modules on stages")

    def existing(paths) -> set:
        out = set()
        for rel in paths:
            try:
                model.get_submodule(join(owner_path, rel))
                out.add(join(owner_path, rel))
            except AttributeError:
                pass                                 # optional (a pooler HF left out)
        return out

    plan = StagePlan(owner_path, stacks[0].path, total, chunks, [], [], list(model.state_dict().keys()),
                     stacks, counts, tuple(sorted(existing(split.shaped))))
    V = len(counts)
    # who holds the named modules: (role, virtual stage)
    roles: dict[str, tuple[str, int]] = {}
    if split.then is None:
        roles.update({p: ("last", V - 1) for p in existing(split.last)})
    else:
        first_end, second_start = stacks[0].stop - 1, stacks[1].start
        roles.update({p: ("last", plan.virtual_stage_of(first_end)) for p in existing(split.last)})
        roles.update({p: ("first", plan.virtual_stage_of(second_start)) for p in existing(split.then.first)})
        roles.update({p: ("last", V - 1) for p in existing(split.then.last)})
    skip = {st.path for st in stacks}

    def walk(module: nn.Module, path: str, inside_owner: bool):
        for child_path, child in _child_paths(module, path):
            if child_path in skip:
                continue
            if child_path in roles:
                if _has_params(child):
                    plan.placed.append((child_path, *roles[child_path]))
                continue
            if child_path == owner_path or any(st.path.startswith(child_path + ".") for st in stacks):
                walk(child, child_path, inside_owner or child_path == owner_path)
                continue
            if not _has_params(child) or child_path in everywhere:
                continue                             # kept on every stage
            plan.placed.append((child_path, "first", 0) if inside_owner else (child_path, "last", V - 1))

    walk(model, "", owner_path == "")
    # Parameters that are one object in modules held by different virtual stages (tied embeddings / LM head).
    where: dict[int, dict[int, str]] = {}
    for path, _, vs in plan.placed:
        for pname, p in model.get_submodule(path).named_parameters(remove_duplicate=False):
            where.setdefault(id(p), {}).setdefault(vs, f"{path}.{pname}")
    plan.shared = [tuple(held[vs] for vs in sorted(held)) for held in where.values() if len(held) > 1]
    if call_module is None:
        _check_layer_ties(plan, lists, manager, name)
    layer_params = {id(p) for layers in lists for p in layers.parameters()}
    outside = {id(p) for path, _, _ in plan.placed for p in model.get_submodule(path).parameters()}
    if layer_params & outside:
        raise ValueError(f"{name}: a parameter of {where_layers} is also held outside the layers; "
                         f"pipeline parallelism cannot place it on one stage")
    plan.call_module, plan.holders = call_module, holders
    plan.everywhere = [path for path in everywhere if _has_params(_module_or_param(model, path))]
    plan.count = _checked_count(model, split, stacks[0], len(lists[0]), name)
    plan.batch_dims = dict(split.batch_dims)
    plan.reads = _checked_reads(split, total, name, where_layers)
    if split.shaped_layers:
        if split.then is not None or split.calls is not None or split.count:
            raise ValueError(f"{name}: a pipeline split running the layers before each chunk in shapes only "
                             f"(shaped_layers=True) takes one list of distinct layers iterated by the forward, "
                             f"not a second stack, repeated calls or a layer count")
        plan.layer_shadows = [_without_hooks(_meta_shadow(layer)) for layer in lists[0]]
    return plan


def _checked_reads(split: StageSplit, total: int, name: str, where: str) -> tuple[int, ...]:
    """split.reads as sorted indices 0..total (a negative k counts from the
    end, as a tuple index does); ValueError for one out of range, or with a
    second stack or repeated calls (one list of distinct layers only)."""
    if not split.reads:
        return ()
    if split.then is not None or split.calls is not None:
        raise ValueError(f"{name}: a pipeline split reading hidden states after the layers (reads={split.reads!r}) "
                         f"takes one list of distinct layers, not a second stack or repeated calls")
    bad = [k for k in split.reads if isinstance(k, bool) or not isinstance(k, int) or not -(total + 1) <= k <= total]
    if bad:
        raise ValueError(f"{name}: pipeline split reads hidden states {bad} of {where}, which has {total + 1} "
                         f"(0..{total}: the input of each of its {total} layers, then the last one's output)")
    return tuple(sorted({k % (total + 1) for k in split.reads}))


def _module_or_param(model: nn.Module, path: str):
    """The sub-module or Parameter at `path` (AttributeError when neither)."""
    try:
        return model.get_submodule(path)
    except AttributeError:
        return model.get_parameter(path)


def _everywhere_paths(model: nn.Module, owner_path: str, names) -> list[str]:
    """StageSplit.everywhere as full paths: each name is a sub-module or a
    Parameter under the owner, or else under the model (SAM's image-wide
    positional embedding, computed by SamModel before its vision encoder); a
    name the model lacks is skipped (BEiT without a shared bias table)."""
    out = []
    for rel in names:
        for path in (f"{owner_path}.{rel}" if owner_path else rel, rel):
            try:
                _module_or_param(model, path)
            except AttributeError:
                continue
            out.append(path)
            break
    return out


def _check_layer_ties(plan: StagePlan, lists: list, manager, name: str) -> None:
    """A parameter tied between layers (one object in two layers of the
    list) must stay on one pipeline rank: there the tie holds (one
    parameter, its gradient the sum of both layers'); across ranks each
    stage would step its copy with its own layers' gradient alone.  The
    schedules sum gradients over stages only for the tied sets outside the
    layers (input embedding / LM head) and the modules they replicate, so a
    tie across stages is refused, naming both parameters and stages."""
    held: dict[int, dict[int, str]] = {}
    for spec, layers in zip(plan.stacks, lists):
        for j, layer in enumerate(layers):
            stage = manager.stage_of(plan.virtual_stage_of(spec.start + j))
            for pname, p in layer.named_parameters(remove_duplicate=False):
                held.setdefault(id(p), {}).setdefault(stage, f"{spec.path}.{j}.{pname}")
    for stages in held.values():
        if len(stages) > 1:
            (sa, a), (sb, b) = sorted(stages.items())[:2]
            raise ValueError(
                f"{name}: {a} and {b} are one parameter (tied), held by layers on different pipeline stages "
                f"({sa} and {sb}); each stage would step its own copy with its own layers' gradient. Untie "
                f"them, or place both layers on one stage (PipelineStageManager's num_layers_per_stage)")


def _checked_count(model: nn.Module, split: StageSplit, stack: "_StackSpec", size: int, name: str) -> str:
    """split.count, checked: the module holding the layer list has that
    attribute and it counts the list's layers (ValueError otherwise); one
    stack of distinct layers only."""
    if not split.count:
        return ""
    if split.then is not None or split.calls is not None:
        raise ValueError(f"{name}: a pipeline split whose forward loops over a layer count (count={split.count!r}) "
                         f"takes one list of distinct layers, not a second stack or repeated calls")
    holder, attr = _count_holder(model.get_submodule(stack.module), split.count)
    value = getattr(holder, attr, None)
    if isinstance(value, bool) or not isinstance(value, int) or value != size:
        raise ValueError(f"{name}: pipeline parallelism sets {stack.module or type(model).__name__}.{split.count} "
                         f"to each chunk's layer count; it is {value!r}, expected the {size} layers of {stack.path}")
    return split.count


def _count_holder(module: nn.Module, count: str):
    """(object, attribute) of StageSplit.count under `module`: a dotted name
    reaches through attributes ("config.num_hidden_layers": the Q-Former's
    encoder loops over its config's layer count)."""
    *path, attr = count.split(".")
    for part in path:
        module = getattr(module, part, None)
    return module, attr


def _call_modules(model: nn.Module, attribute: str, num_modules: int, name: str, layers_path: str) -> tuple[int, ...]:
    """The module index of each call (StageSplit.calls): N = config.`attribute`
    calls over the G modules, call i running module i*G//N; ValueError unless
    N is a positive multiple of G (every module then runs N/G consecutive
    calls, which is how the forward indexes them)."""
    config = getattr(model, "config", None)
    n = getattr(config, attribute, None)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{name}: pipeline parallelism splits the calls of {layers_path}, counted by "
                         f"config.{attribute}; the config has {attribute}={n!r}")
    if num_modules < 1 or n % num_modules:
        raise ValueError(f"{name}: pipeline parallelism splits the {n} calls (config.{attribute}) of the "
                         f"{num_modules} modules of {layers_path} over the stages only when each module runs the "
                         f"same number of consecutive calls; {n} is not a multiple of {num_modules}")
    return tuple(i * num_modules // n for i in range(n))


def _module_holders(manager, call_module: tuple[int, ...], where: str) -> dict[int, tuple[int, ...]]:
    """{module: the stages (ranks of the pipeline group, ascending) whose calls run it}."""
    counts = manager.distribute_layers(len(call_module), where)
    holders: dict[int, set] = {}
    start = 0
    for vs, count in enumerate(counts):
        for i in range(start, start + count):
            holders.setdefault(call_module[i], set()).add(manager.stage_of(vs))
        start += count
    return {g: tuple(sorted(stages)) for g, stages in sorted(holders.items())}


# Per-layer outputs a pipelined forward does not give (StageRuntime.refuse_outputs).
OUTPUT_FLAGS = ("output_hidden_states", "output_attentions")
DOCS_OUTPUTS = "docs/pipeline.md#per-layer-outputs"
DOCS_OUTPUTS_SWIN = "docs/pipeline.md#swin-and-swinv2"
TUPLE_WITH_CACHE = "return_dict=False with use_cache=True"


class StageRuntime:
    """One pipelined model's state on this rank: what runs, and the
    activation handed to the running chunk.  Attached to the model
    (runtime_of); the schedules drive it.

    Messages between stages are one tensor (the hidden states), or, for a
    split with carry or two stacks (plan.tuples), a tuple of tensors:

        inside a stack       (hidden states, carried outputs...)      first stack
                             (hidden states, carried outputs..., the first stack's output)   second
        at the stack edge    (the first stack's output,)   a chunk ending with the first stack

    A chunk that starts in the second stack does not run the first: the
    model is called with the received first-stack output under the second
    stack's `skip` keyword (HF's encoder_outputs)."""

    def __init__(self, plan: StagePlan, manager, name: str, tp_group=None):
        self.model_name = name
        self.manager = manager
        self.tp_group = tp_group                     # the stage's tensor-parallel group
        self.plan = plan
        self.messages_are_tuples = plan.tuples
        self.own_mean_loss = False                   # the model's loss ignores num_items_in_batch (sharder)
        # groups beyond the pipeline whose ranks must run the same schedule steps, as (group, what): the
        # expert-parallel group, whose token exchanges run inside each forward and backward (sharder)
        self.lockstep_groups: list = []
        self.layers: StageLayers | None = None       # the first stack's
        self.all_layers: list[StageLayers] = []
        self.chunk: int | None = None
        self.entry = None                            # the message the running chunk starts from
        self.decoding = False                        # inside generate() (shardformer.pipeline.generate)
        self.entered = False
        # the tied sets this rank holds, {stage: parameter} (what optimize() returns as shared_params)
        self.shared_params: list[dict[int, nn.Parameter]] = []
        # modules replicated over several stages (StageSplit.calls / everywhere): (holder stages,
        # parameter name, this rank's parameter)
        self.replicated_params: list[tuple[tuple[int, ...], str, nn.Parameter]] = []
        # both of the above, one list: every parameter this rank holds that other stages hold too,
        # as (holder stages, key, this rank's parameter); see held_by_several.  Bound by bind_shared.
        self.held_by_several: list[tuple[tuple[int, ...], str, nn.Parameter]] = []
        # The shape of the first layer's input on the first virtual stage (the embeddings' output),
        # sent along with the activations: a later stage's stand-ins take it, which differs from
        # the received activation's under sequence parallelism (this rank's rows only).
        self.input_shape: tuple | None = None
        # sequence-parallel states (SequenceState, SequenceSplit) told the sequence length when a
        # chunk starts from received rows (their split ran on the first stage)
        self.sequence_states: list = []
        # the same per stack (plan.stacks order; two stacks have a state each): a chunk entering one
        # stack tells that stack's states only
        self.stack_states: list[list] = []
        # StageSplit.reads: {k: hidden state k} recorded or received in the running chunk
        self.taps: dict[int, torch.Tensor] = {}

    # -- the schedule's side ----------------------------------------------------------

    def outputs_asked(self, model: nn.Module, batch: dict) -> tuple[str, ...]:
        """The outputs `batch` asks of `model` that a pipeline does not give:
        the per-layer ones (OUTPUT_FLAGS set True in the batch, or in the
        model's config where the batch leaves them out), as "flag=True" or
        "config.flag=True", and TUPLE_WITH_CACHE (a tuple output that would
        hold a cache).  The schedules agree on it over the stages before
        refuse_outputs."""
        config = getattr(model, "config", None)
        asked = []
        for flag in OUTPUT_FLAGS:
            if flag in batch:
                if batch[flag]:
                    asked.append(f"{flag}=True")
            elif getattr(config, flag, False):
                asked.append(f"config.{flag}=True")
        # the stages run without a cache (the schedules pass use_cache=False): a tuple would lack the
        # cache the unsharded model returns, and every later entry would move up one place
        if "use_cache" in inspect.signature(type(model).forward).parameters \
                and not batch.get("return_dict", getattr(config, "return_dict", True)) \
                and batch.get("use_cache", getattr(config, "use_cache", False)):
            asked.append(TUPLE_WITH_CACHE)
        return tuple(asked)

    def refuse_outputs(self, model: nn.Module, batch: dict, asked: tuple[str, ...] | None = None) -> None:
        """NotImplementedError for output_hidden_states / output_attentions
        (outputs_asked; `asked`: its value, already agreed over the stages),
        on every rank alike, before any message.  Every family: hidden state
        k (k = 0..L, the embeddings' output and each layer's) and layer k's
        attention weights are made on the stage holding layer k, and a
        message between stages carries the activation (and StageSplit's
        carry / reads) only, so the last stage's output would hold its own
        layers' entries alone (the schedules would then drop those tuples
        from the gathered outputs).  A Swin split (StageSplit.shaped_layers)
        runs the earlier Swin stages in shapes only, so neither exists there."""
        asked = self.outputs_asked(model, batch) if asked is None else asked
        if not asked:
            return
        layers, flags = self.plan.layers_path, [a for a in asked if a != TUPLE_WITH_CACHE]
        if not flags:
            raise NotImplementedError(
                f"{self.model_name}: {TUPLE_WITH_CACHE} (in the batch or the config) under pipeline parallelism: "
                f"the stages run without a cache, so the output tuple would lack past_key_values and every entry "
                f"after it would move up one place against the unsharded model's; pass use_cache=False (the "
                f"unsharded model's tuple without a cache) or return_dict=True ({DOCS_OUTPUTS})")
        why = (f"the stages before the last one's chunk of {layers} run elsewhere (in shapes only on the last "
               f"stage), so their hidden states and attentions are not on the last stage; leave them False "
               f"({DOCS_OUTPUTS_SWIN})" if self.plan.layer_shadows else
               f"each stage makes the hidden states and attentions of its own layers of {layers} only, and the "
               f"messages between stages carry the activation alone, so the last stage cannot return one entry "
               f"per layer as the unsharded model does; leave them False and read per-layer outputs from an "
               f"unsharded or tensor-parallel-only forward ({DOCS_OUTPUTS})")
        raise NotImplementedError(f"{self.model_name}: {' and '.join(flags)} under pipeline parallelism "
                                  f"({self.manager.num_stages} stages): {why}")

    def chunk_range(self) -> range:
        """The running chunk's layers (indices in the concatenated list)."""
        return self.plan.chunks[self.chunk]

    def swaps_entry(self) -> bool:
        """Whether the running chunk's first layer takes the received message
        (False on the first virtual stage, and where the chunk starts a stack)."""
        start = self.chunk_range().start
        return self.entry is not None and all(st.start != start for st in self.plan.stacks)

    def states_of(self, spec: "_StackSpec") -> list:
        """The sequence-parallel states of the stack `spec` (stack_states)."""
        k = self.plan.stacks.index(spec)
        return self.stack_states[k] if k < len(self.stack_states) else []

    def _first_hidden(self, entry):
        return entry[0] if isinstance(entry, tuple) else entry

    # -- StageSplit.reads ------------------------------------------------------------------

    def receive_reads(self, skip: int) -> None:
        """The read hidden states in the received message (after the hidden
        states and `skip` carried tensors), for the running chunk."""
        ks = self.plan.reads_before(self.chunk_range().start)
        if ks:
            self.taps.update(zip(ks, self.entry[1 + skip:1 + skip + len(ks)]))

    def reads_sent(self, end: int) -> tuple:
        """The read hidden states a message leaving before layer `end`
        carries.  Each is a view, so that one the chunk received and sends on
        unchanged takes its gradient through the graph to the received tensor."""
        out = []
        for k in self.plan.reads_before(end):
            if k not in self.taps:
                raise RuntimeError(f"{self.model_name}: pipeline chunk {self.chunk} has no hidden state {k} of "
                                   f"{self.plan.layers_path} to send on (StageSplit.reads)")
            out.append(self.taps[k].view_as(self.taps[k]))
        return tuple(out)

    def _record_read(self, k: int):
        """Forward pre-hook of layer k: its input is hidden state k."""
        def hook(module, args, kwargs):
            if self.chunk is not None:
                self.taps[k] = args[0] if args else kwargs["hidden_states"]
        return hook

    def _full_hidden_states(self, module, args, output):
        """Forward hook on the owner (StageSplit.reads): on the last stage,
        output.hidden_states (captured for the layers this stage ran) in the
        whole model's numbering; see the module docstring."""
        if self.chunk is None or not self.manager.is_last_stage(self.chunk):
            return None
        local = getattr(output, "hidden_states", None)
        if local is None:
            return None
        start = self.chunk_range().start
        full = [self.taps.get(k) for k in range(start)] + list(local)
        output["hidden_states"] = tuple(full)
        return output

    def run(self, model: nn.Module, chunk: int, entry, kwargs: dict, input_shape: tuple | None = None,
            call=None):
        """The model's forward on `kwargs` for this rank's `chunk`, starting
        from `entry` (None on the first virtual stage; a tensor, or a tuple
        of tensors when plan.tuples; `input_shape`: the first stage's layer
        input shape, default the entry's hidden states'): the model's output
        on the last virtual stage, else the chunk's output message.
        Afterwards `input_shape` is the first stage's layer input shape.
        `call`: what runs the forward (default `model`, through its hooks;
        generate() passes the model's own forward, its hooks having run on
        the call generate made)."""
        for layers in self.all_layers:
            layers.active = chunk
        self.chunk, self.entry, self.entered = chunk, entry, False
        self.taps = {}
        for layers in self.all_layers:
            layers.begin()
        for state in self.sequence_states:
            if hasattr(state, "begin"):
                state.begin()
        self.input_shape = tuple(input_shape) if input_shape is not None else \
            (tuple(self._first_hidden(entry).shape) if entry is not None else None)
        second = self.plan.stacks[-1]
        if len(self.plan.stacks) > 1 and self.chunk_range().start >= second.start:
            kwargs = dict(kwargs, **{second.skip: (entry[-1],)})    # the first stack's output: not rerun
        restore = self._set_count(model)
        try:
            out = (model if call is None else call)(**kwargs)
        except StageExit as e:
            out = e.hidden
        finally:
            restore()
            for layers in self.all_layers:
                layers.active = None
            self.chunk, self.entry = None, None
        if entry is not None and not self.entered:
            raise RuntimeError(f"{self.model_name}: pipeline chunk {chunk} never ran its first layer "
                               f"({self.plan.layers_path}); the model's forward skipped it")
        return out

    def _set_count(self, model: nn.Module):
        """StageSplit.count: the layer count the forward loops over becomes
        the running chunk's; returns what puts the model's back."""
        if not self.plan.count:
            return lambda: None
        holder, attr = _count_holder(model.get_submodule(self.plan.stacks[0].module), self.plan.count)
        saved = getattr(holder, attr)
        setattr(holder, attr, len(self.chunk_range()))
        return lambda: setattr(holder, attr, saved)

    def unsplit_shape(self, computed: torch.Tensor) -> tuple:
        """The shape of the first layer's input on the first stage, before any
        sequence split: `computed`'s, except where a split ran before the
        layers in this forward (ALBERT splits at its encoder's input): there
        its sequence dimension is the state's unpadded length."""
        shape = list(computed.shape)
        for state in self.sequence_states:
            if getattr(state, "split_in_forward", False):
                shape[state.dim] = state.length
        return tuple(shape)

    def stand_in(self) -> torch.Tensor:
        """What a first-stage module returns on a stage that does not run it:
        zeros shaped like the first stage's layer input (`input_shape`), so
        the model's forward builds masks and positions for the true sequence
        length, which the received activation does not show under sequence
        parallelism."""
        if self.entry is None:
            raise RuntimeError(f"{self.model_name}: a first-stage module ran outside a pipeline schedule")
        hidden = self._first_hidden(self.entry)
        return torch.zeros(self.input_shape, dtype=hidden.dtype, device=hidden.device)

    def shaped_stand_in(self, shadow: nn.Module, args, kwargs):
        """Zeros shaped like the output the module (its meta copy `shadow`)
        would give on these arguments, its non-tensor outputs as computed
        (StageSplit.shaped; Swin's embeddings return (tensor, (height, width)))."""
        return shape_run(shadow, args, kwargs)

    # -- the redirections ---------------------------------------------------------------

    def _first_forward(self, module: nn.Module, path: str, holder: int):
        """A first-role module's forward on a rank that holds it (for virtual
        stage `holder`) but runs another chunk (interleaved): the stand-in."""
        forward = module.forward
        shadow = _meta_shadow(module) if path in self.plan.shaped else None

        def wrapped(*args, **kwargs):
            if self.chunk is not None and self.manager.virtual_stage(self.chunk) != holder:
                return self.stand_in() if shadow is None else self.shaped_stand_in(shadow, args, kwargs)
            return forward(*args, **kwargs)
        return wrapped

    def _stack_exit(self, module, args, output):
        """Forward hook on the first stack's module (two stacks): a chunk whose
        last layer is the stack's last, and which is not the chain's last,
        ends with the stack's output (after its final norm)."""
        if self.chunk is None or self.manager.is_last_stage(self.chunk):
            return None
        if self.chunk_range().stop == self.plan.stacks[0].stop:
            hidden = output if isinstance(output, torch.Tensor) else output[0]
            raise StageExit((hidden,))
        return None

    def _refuse_outside(self, module, args, kwargs):
        if self.chunk is None and not self.decoding:
            raise RuntimeError(
                f"{self.model_name}: pipeline stage {self.manager.stage} of {self.manager.num_stages} holds "
                f"layers {[f'{r.start}-{r.stop - 1}' for r in self.plan.chunks]} only; run it through a schedule "
                f"(shardformer.pipeline: schedule.forward(model, batch) or forward_backward_step), or call "
                f"model.generate(...) on every rank (docs/pipeline.md#generate)")

    # -- applying the plan ------------------------------------------------------------

    def _mine(self, vs: int) -> bool:
        return self.manager.stage_of(vs) == self.manager.stage

    def apply(self, model: nn.Module) -> None:
        """Drop what other stages hold and install the redirections (the plan was checked)."""
        plan, sm = self.plan, self.manager
        # the tied sets: {stage: this rank's name of it} (bound to parameters by bind_shared);
        # the lowest holding stage's copy is the one that counts once (gradient norms)
        self.tied_owner_stage = sm.stage_of(0)
        vs_of = {path: vs for path, _, vs in plan.placed}
        self._shared_names = []
        self._replicated_names = []
        for index, names in enumerate(plan.shared):
            held = {}
            for name in names:
                path = next(p for p in vs_of if name.startswith(p + "."))
                held.setdefault(sm.stage_of(vs_of[path]), name)
            if len(held) < 2:
                continue                            # one rank holds all: still one Parameter
            mine = {stage: name for stage, name in held.items() if stage == sm.stage}
            if mine:       # keyed by the set's index in the plan: the same on every holder
                self._shared_names.append((tuple(sorted(held)), mine, f"tied.{index}"))
        if sm.num_stages > 1:
            every = tuple(range(sm.num_stages))
            for path in plan.everywhere:
                held = _module_or_param(model, path)
                self._replicated_names += [(every, path)] if isinstance(held, nn.Parameter) else \
                    [(every, f"{path}.{pname}") for pname, _ in held.named_parameters()]
        for path, role, vs in plan.placed:
            if self._mine(vs):
                if role == "first" and sm.num_model_chunks > 1:
                    module = model.get_submodule(path)
                    module.forward = self._first_forward(module, path, vs)
            else:
                _set(model, path, StageAbsent(path, role, sm.stage_of(vs), self, model.get_submodule(path)))
        for spec in plan.stacks:
            self.all_layers.append(self._stack_layers(model, spec))
        self.layers = self.all_layers[0]
        if len(plan.stacks) > 1:
            model.get_submodule(plan.stacks[0].module).register_forward_hook(self._stack_exit)
        if plan.reads:
            for k in plan.reads:
                if k < plan.total and str(k) in self.layers._modules:
                    self.layers._modules[str(k)].register_forward_pre_hook(self._record_read(k), with_kwargs=True)
            model.get_submodule(plan.owner_path).register_forward_hook(self._full_hidden_states)
        model.register_forward_pre_hook(self._refuse_outside, with_kwargs=True, prepend=True)
        model.__dict__[RUNTIME] = self

    def _stack_layers(self, model: nn.Module, spec: _StackSpec) -> StageLayers:
        """One stack's StageLayers (its own indices), with the chunk edges:
        a chunk enters at its first layer in the stack (or the stack's first,
        which records the stack's input shape) and leaves at its last, unless
        that ends the chain or the first of two stacks (_stack_exit)."""
        sm = self.manager
        old = model.get_submodule(spec.path)
        local = [range(max(r.start, spec.start) - spec.start, max(min(r.stop, spec.stop), spec.start) - spec.start)
                 for r in self.plan.chunks]
        call_module = self.plan.call_module
        if call_module is None:
            held = {i: old[i] for r in local for i in r}
            layers = StageLayers(held, spec.stop - spec.start, local, spec.path)
        else:                                        # StageSplit.calls: the modules this rank's calls run
            held = {g: old[g] for g in sorted({call_module[i] for r in local for i in r})}
            layers = StageCalls(held, call_module, local, spec.path)
            for g, module in held.items():
                if len(self.plan.holders[g]) > 1:
                    self._replicated_names += [(self.plan.holders[g], f"{spec.path}.{g}.{pname}")
                                               for pname, _ in module.named_parameters()]
        layers.train(old.training)
        _set(model, spec.path, layers)
        layers.__dict__["_runtime"] = self
        layers.__dict__["_spec"] = spec
        layers.__dict__["_positional"] = bool(self.plan.count)
        layers.__dict__["_shadows"] = self.plan.layer_shadows
        edges = {}
        last_stack = spec is self.plan.stacks[-1]
        for c, (r, mine) in enumerate(zip(self.plan.chunks, local)):
            if not len(mine):
                edges[c] = {}
                continue
            leave = None if sm.is_last_stage(c) or (r.stop >= spec.stop and not last_stack) else mine.stop - 1
            edges[c] = {"enter": mine.start, "exit": leave}
        layers.__dict__["_edges"] = edges
        return layers

    def bind_shared(self, model: nn.Module) -> list[dict[int, nn.Parameter]]:
        """Bind the parameters held by several stages, once the model's
        parameters are final (a lazy_init() model gets its replicated
        parameters after apply()): held_by_several, and its two sources,
        shared_params ({stage: parameter} of every tied set this rank holds,
        returned) and replicated_params."""
        self.shared_params = [{stage: model.get_parameter(name) for stage, name in names.items()}
                              for _, names, _ in self._shared_names]
        self.replicated_params = [(stages, name, model.get_parameter(name))
                                  for stages, name in self._replicated_names]
        self.held_by_several = [(holders, key, next(iter(pair.values())))
                                for (holders, _, key), pair in zip(self._shared_names, self.shared_params)]
        self.held_by_several += self.replicated_params
        return self.shared_params

    def counted_elsewhere(self) -> set[int]:
        """ids of this rank's parameters whose gradient another stage counts
        (a gradient norm counts each parameter once): those held by several
        stages (held_by_several), on every holder but the lowest."""
        return {id(t) for holders, _, t in self.held_by_several if self.manager.stage != holders[0]}


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    module.train(model.get_submodule(path).training)     # a stand-in keeps the mode of what it replaces
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def runtime_of(model: nn.Module) -> StageRuntime | None:
    """The StageRuntime of a pipelined model (None for one that is not)."""
    return model.__dict__.get(RUNTIME)
