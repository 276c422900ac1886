"""What a run tells: the events' fields, writer, tail reader and fold; heartbeats and stacks; activations;
peak FLOP/s; profiles."""
