"""Built-in scheduling policies; each module is a plugin listed in the ``pagebatch`` entry points."""
