"""Tools on top of the library: the memory plan, activation-memory estimates and MoE route
diagnostics, used by scripts and console commands. They may import any layer below; nothing in the
library imports them. (The evidence study's tooling lives outside the package, in scripts/study_tools/.)"""
