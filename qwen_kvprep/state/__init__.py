"""The state `fix` records: `writer.py` records it (engines), `reader.py` reads
`state.json` back and checks its schema (base, standard library only: prestart's fast
path reads it on every container start). Nothing is imported here, so the fast path
loads the reader alone."""
