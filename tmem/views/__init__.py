"""The embedding views: which texts of a conversation's memory get embedded (texts.py) and embedding them (embed.py), DESIGN.md §3."""
