"""The engine: decide (sequences, scheduler, block manager, sampler) and one runner that executes."""
