"""Source text of a stand-in server for the benchmark tests: ``serve_health(port)`` answers
``GET /health`` with 200 (anything else 404) until killed. Prepended to a ``python -c`` script."""

HEALTH_SERVER = """
import http.server

class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass

def serve_health(port):
    http.server.HTTPServer(("127.0.0.1", port), _Health).serve_forever()
"""
