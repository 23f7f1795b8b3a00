"""Tools on top of the library (the study, the memory plan): they may import any layer below."""
