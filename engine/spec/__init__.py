"""Speculative decoding: propose, verify, and decide how many to propose.

`config` is vLLM's `speculative_config`; `proposers` builds the proposer it names (`ngram_proposer`,
`draft_proposer`, `eagle3_proposer`); `decode` proposes before a step and verifies after it with
`rejection_sampler`; `budget` picks proposal lengths from the step costs it measures.
"""
