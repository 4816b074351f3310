"""Pipeline parallelism: schedules as data, their validator and simulator, and timeline charts."""
