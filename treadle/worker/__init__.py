"""Workers: the model runner, persistent request slots, the sampler."""
