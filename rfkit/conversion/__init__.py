"""From a pretrained model to a converted one: profile the heads, select them with a policy,
replace them with an operator, record the head map and model card.
"""
