"""The simulated worker (SIMULATED: holds no model): speaks the worker protocol and answers each
step plan after the time a cost model gives for that step on a named device and model.

Modules: profiles (devices, model shapes), cost_model (the step time formula), tokens
(deterministic output tokens), runner (SimRunner), overhead (the engine's own time per step),
calibrate (fit a device profile to measured step times). docs/simulator.md describes them.
"""
