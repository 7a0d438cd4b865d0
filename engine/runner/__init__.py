"""The worker side: the model, its G1 tensors and one forward per step.

`model_runner` turns a step's plan into a forward (`input_batch` holds the block tables as one
tensor); `attention` reads and writes the paged cache through `attention_cpu` (the C++ kernels of
`engine/cpu_kernels`) or `attention_triton` (`engine/kernels`); `compiled` wraps the model in
torch.compile; `loader` reads a checkpoint; `cpu_runtime` and `cpu_threads` set the CPU process up
(allocator, ISA, threads that follow what the CPUs can give).
"""
