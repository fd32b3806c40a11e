"""The reference engine: real speculative decoding on a small model.

- :mod:`worker.reference.engine` — the decode ladder (draft → tree → verify →
  accept → cache), kernels, KV cache, sampling, calibration;
- :mod:`worker.reference.drafters` — n-gram, Medusa, EAGLE and the oracle;
- :mod:`worker.reference.heads` — draft-head modules, data and training;
- :mod:`worker.reference.models` — loading the target model (GGUF or a seeded tiny config);
- :mod:`worker.reference.server` — the HTTP generate endpoint that follows the controller;
- :mod:`worker.reference.prompts`, :mod:`worker.reference.load` — prompt sets and a load generator.
"""
