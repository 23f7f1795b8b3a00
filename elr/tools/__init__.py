"""Tools on top of the library: the memory plan, activation-memory estimates, MoE route diagnostics and the
data benchmarks, used by scripts and console commands. They may import any layer below; nothing in the
library imports them. (The evidence study's tooling lives outside the package, in scripts/study_tools/.)"""
