"""compression package."""
