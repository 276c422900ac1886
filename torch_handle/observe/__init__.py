"""What a run tells: the event schema, writer, tail reader and fold; heartbeats, hang detection, stacks; peak FLOP/s; profiles."""
