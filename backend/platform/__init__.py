"""What this machine can do (CPU features, oneDNN packing) and the process's one OpenMP
team. Import-light; every layer, and compression, may import it.
"""
