"""A discrete-time model of the engine fleet that runs the tuner's own policy."""
