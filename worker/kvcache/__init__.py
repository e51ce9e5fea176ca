"""KV-cache compression: the TurboQuant vector codec (`turboquant`) and the staged-page layer
helpers (`staged`) that keep recent pages in FP8 and re-encode aged pages to TurboQuant codes."""
