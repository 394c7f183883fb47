"""A schedule on the device: the micro-batch's token ids and attention metadata, the
sampler's state and the draw from the logits, and the speculative verify rule."""
