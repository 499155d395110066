"""Small real HTTP servers standing in for the model, search and reader APIs."""
