"""The optimizer's step on host masters (ZeRO-Offload), for both engines.

* ``masters.py``: the master rows where the optimizer steps them, on the host or the device, the host buffers their
  gradients pass through and the stream that copies them;
* ``host_step.py``: one call of the host step, the sequence every mode runs (and torch's fused CPU kernel);
* ``worker.py``: the thread host steps run in beside training;
* ``speculation.py``: a part stepped during backward before the clipping coefficient is known, and its undo;
* ``schedule.py``: when the step runs, after backward, during it or one step late ([Note: the offloaded step]).
"""
