"""A picture of a report page: headless Chromium draws an HTML file into a PNG.

    python -m experiments.report results/demo --screenshot docs/gallery/report.png

Optional by design: without a browser the report is still written, and the
line returned says which browsers were looked for and how to install one.
"""
import os
import shutil
import subprocess

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def screenshot(page, png, size=(1280, 2400)):
    """Draws `page` (an HTML file) into `png` with a headless Chromium; returns a line
    saying what happened.  Never raises: a report without its picture is still a report."""
    browser = next((b for b in map(shutil.which, BROWSERS) if b), None)
    if browser is None:
        return (f"no screenshot: none of {', '.join(BROWSERS)} is installed "
                "(Debian: apt-get install chromium)")
    png = os.path.abspath(png)
    os.makedirs(os.path.dirname(png), exist_ok=True)
    # --no-sandbox: Chromium refuses to run as root with its sandbox on (containers, CI)
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           f"--screenshot={png}", f"--window-size={size[0]},{size[1]}",
           "file://" + os.path.abspath(page)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"no screenshot: {browser} failed ({e})"
    if done.returncode != 0 or not os.path.exists(png):
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return f"no screenshot: {browser} exited {done.returncode} ({tail[0]})"
    return f"drew {page} into {png}"
