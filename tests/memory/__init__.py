"""The memory estimator (nybble.memory): the allocator simulations, the estimate and its
command, the measurement scripts, and the estimator fuzz suite."""
