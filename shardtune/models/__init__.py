"""What is particular to each model family, as data: the shape fields read from config.json, the published configs
kept as built-in shapes, the tiny configs the tests train, the mixtures of experts' fields (experts.py) and router loss
(routing.py), and the levers a family refuses (the model is transformers')."""
