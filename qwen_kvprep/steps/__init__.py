"""The actions of `fix`, one module each."""
