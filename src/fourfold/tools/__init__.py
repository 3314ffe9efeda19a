"""The runtime under fake tensors and a fake process group: one rank's memory (measure) and a whole
job's rank (simulate)."""
