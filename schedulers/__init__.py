"""Built-in scheduling policies; each module is a plugin in the ``pagebatch`` entry points."""
