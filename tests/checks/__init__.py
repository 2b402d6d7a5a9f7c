"""Rank-side checks: functions that run on every rank of the test pool.

A test sends one of these to the pool (tests/dist_pool.py, the `pool`
fixture): `pool.run(checks.parity.check_model, tp, name)` runs
`fn(ctx, *args)` on ranks [0, tp) and returns their results by rank.  The
ranks import the function by its module name, so it must live in a module
(here, or the test file itself), not in a closure.

    parity         a sharded model against the unsharded one from the same seed
                   (outputs, loss, every gradient, a step; generate()); the
                   tolerances every other check uses
    layers         parallel layers, region operators, collectives, vocabulary-
                   parallel cross-entropy, dropout masks
    sharder        custom policies on a user's model; a failed optimize()
                   leaves the model as it was
    checkpoints    save_pretrained, gather_full_state_dict, full state dicts
                   across TP sizes
    runtime_state  eval/train, frozen parameters, hooks, HF flags, gradient
                   checkpointing survive sharding
    replicas       ranks holding different models are refused; broadcast_weights
    optimizations  the fused kernels the sharder applies, against the unsharded model
    encoders       the encoder / encoder-decoder families and ChatGLM2 (zoo.encoders)
"""
