"""The step loop and its bookkeeping (scheduler side: no tensors).

`engine_core.EngineCore.step()`: poll finished loads, schedule, run, sample, update. `scheduler`
plans each step under the token budget (`step_cost` learns what a step costs, for the share of
expensive work); `request` is a request's state and `request_factory` builds validated ones;
`async_pipeline` plans step N+1 while step N runs; `isolation` pins a failing forward on its
request; `setup`, `connector_setup` and `gpu_memory` are start-up decisions; `stats` the counters.
"""
