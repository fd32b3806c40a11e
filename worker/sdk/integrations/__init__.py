"""Third-party engines under the controller, each through the engine's own
extension points (no change to the engine).

- :mod:`worker.sdk.integrations.llamacpp` — llama.cpp's speculative decoding
  through llama-cpp-python: a draft model whose depth the plan sets per step
  (extra ``llamacpp``).

Each module imports its engine's binding at import time; nothing else in the
SDK imports them.
"""
