# Records JSON bodies POSTed to it (the alert webhook), one line each, in /tmp/nm/ops/alerts.jsonl.
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        with open("/tmp/nm/ops/alerts.jsonl", "a") as f:
            f.write(body.decode() + "\n")
        self.send_response(200); self.end_headers()
    def log_message(self, *a): pass
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
