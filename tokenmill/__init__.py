"""tokenmill: the `tokenmill` command (`tokenmill.cli`) and the settings every part reads
(`tokenmill.settings`). The command sits above everything; the settings below everything."""
