"""Tools a policy calls during multi-turn rollouts (docs/tools.md): the Tool type, parsing calls out of the
model's text, running one turn's calls, the built-in tools and their sandbox."""
