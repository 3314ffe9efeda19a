"""What a job is, without torch: the grid layout, the job, its rules, the block plan, communication
volumes, counts, hardware presets and the training config. The planner and the runtime both read it."""
