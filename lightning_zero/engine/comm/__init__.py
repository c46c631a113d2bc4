"""Communication below both engines: the collectives every module asks for, their transports, counting,
the flight recorder, quantization and compression, and which ranks talk to which (topology)."""
