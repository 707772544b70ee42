import subprocess, sys
r = subprocess.run([sys.executable, "-c", "import sys; print(sys.argv, __name__)"], capture_output=True, text=True)
print(r.returncode, r.stdout, r.stderr)
