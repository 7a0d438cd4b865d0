"""From logits to tokens, and when to stop.

`sampler` draws the next tokens (per-request generators for seeded requests) after
`logit_controls` (bad words, logit bias, allowed ids, min tokens), `structured` (grammars through
xgrammar) and `thinking` (a reasoning budget) have masked the logits; `prompt_logprobs` scores a
prompt; `stop` decides when a request is done.
"""
