"""The sharding engine. No Lightning imports: everything here is testable with plain torch.

[Note: vocabulary]
The words every module of the package uses in one sense only (FSDP2 keeps its own in ``[Note: FSDP tensors]``):

* **rows**: a parameter's slices along dim 0 (a 0-dim parameter is one row). Sharding is by rows
  (``shard.py``, [Note: one shard convention for every stage]).
* **chunk**: the rows one rank holds, ``ceil(rows / world_size)`` of them, padded to that length when they
  travel; rank ``r`` holds chunk ``r``.
* **bucket** (stages 1-2): a flat buffer of several parameters' gradients reduced by one collective, laid out
  rank-major (``stage12/layout.py``).
* **segment**: rank ``r``'s contiguous share of a bucket, chunk ``r`` of each of its parameters; what a
  reduce-scatter hands rank ``r`` and an all-gather takes from it.
* **unit** (stage 3): the layers one FSDP2 ``fully_shard`` call groups, gathered and reduced together
  (``stage3/fsdp2_units.py``).
* **part**: a share of the optimizer step (about ``1/HOST_STEP_PARTS`` of its elements), stepped on its own so
  that the host step can start before the whole gradient is there (``offload/schedule.py``); a part waits for
  its **pieces**, the buckets (stages 1-2) or units (stage 3) whose reductions bring its gradients.
* **master**: the fp32 copy of a parameter's rows that the optimizer steps when the tensors forward computes
  with are something else (bf16, on another device, compressed); on the host under ``offload_optimizer``.
* **tile** (``optimizer_state_dtype="bf16"``): at most ``TILE_ELEMENTS`` of state widened to fp32 at once for a
  step, whole tensors or flat slices of a larger one (``state_dtype.py``).
* **staged**: copied to the host ahead of the step (a gradient's held sum, as soon as its reduction landed).
* **landed**: a collective's result written into the rows it was for (the work waited on), not merely launched.
* **finalized**: a gradient averaged over ranks (and unscaled) for this step, what the optimizer reads; before
  that the engine holds sums ([Note: gradients are held as sums until finalized] in ``stage12/grad_sync.py``).
* **checkpoint** means saved training state (``lightning_zero/checkpoint/``); recomputing activations in backward
  is **activation checkpointing** (``lightning_zero/activation_checkpointing/``), never "checkpoint" alone.
"""
