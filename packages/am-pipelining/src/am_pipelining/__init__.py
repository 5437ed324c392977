"""Pipeline parallelism for HuggingFace-style models on torch.distributed.pipelining."""
