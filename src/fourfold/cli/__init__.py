"""The command line: `fourfold COMMAND`."""
