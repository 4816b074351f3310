"""Executing a plan: stage split of the model, point-to-point exchange, the schedule
executor, the synchronous pipeline engine and the asynchronous 2BW stream."""
