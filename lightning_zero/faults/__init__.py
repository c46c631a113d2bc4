"""Fault handling that knows nothing of Lightning beyond what it is handed: a collective watchdog with a flight
recorder, the diagnosis of hangs, process-group timeouts and SIGTERM.

* ``flight.py``      what this rank communicated (written by ``engine/comm/collectives.py``, always on)
* ``activity.py``    what the main thread is doing, sampled from another thread
* ``heartbeat.py``     the heartbeat record each rank publishes, and process liveness
* ``diagnosis.py``   pure decisions over records: who diverged, where, and the message
* ``heartbeat_store.py``    the store I/O thread
* ``watchdog.py``    the thread that decides and ends a run that cannot go on; the exit agreement
* ``timeouts.py``    process-group timeouts while a run is active; :func:`extended`
* ``signals.py``     the wakeup pipe that sees SIGTERM while the main thread is blocked; a handler that never
                     communicates
* ``failures.py``    the run's first failure, named in every rank's error

``lightning_zero/strategy/fault_handling.py`` wires them into ``ZeroStrategy``.
"""

from lightning_zero.engine.comm.flight import CollectiveError
from lightning_zero.faults.timeouts import extended

__all__ = ["CollectiveError", "extended"]
