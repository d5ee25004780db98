"""One module per rule, named by its code; each module's docstring is the rule's documentation."""
