"""`kilovla serve`: protocol.py (openpi wire format, layouts), engine.py (the model side), server.py, client.py."""
