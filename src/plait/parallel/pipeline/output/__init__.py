"""What a pipeline shows: Gantt charts, Chrome traces, the `plait schedule` command."""
