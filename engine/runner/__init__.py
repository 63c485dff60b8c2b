"""One engine step as one forward pass: inputs built, the model run, tokens sampled.

`model_runner` (a step's work to a forward pass over the paged pool), `input_batch` (the
running rows' state kept between steps), `sampler`, `logprobs`, `compiled_decode` (the CPU
decode step under `torch.compile`).

May import: `engine.model`, `engine.kv`, `engine.checkpoint`, `engine.sequence`, `engine.config`.
"""
