"""Custom ops: a pure-torch implementation in core for each, dispatched once through the platform."""
