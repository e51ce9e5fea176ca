"""tokenmill: the `tokenmill` command (`tokenmill.cli`) and the settings every part reads
(`tokenmill.settings`), and the finder of optional modules named by string
(`tokenmill.modules`). The command sits above everything; the settings and the finder below
everything."""
