"""The journal of what `fix` changed: `writer.py` makes every change through it (engines),
`reader.py` reads `journal.json` back and checks its schema (base: the data format).
Nothing is imported here, so reading the journal does not load the writer."""
