"""A small English corpus shipped with the package, for training the embedded default vocabulary."""

from tools.corpus import conversations, explainers, stories, technical

CORPUS: tuple[str, ...] = (stories.TEXT, explainers.TEXT, conversations.TEXT, technical.TEXT)
