// A minimal Electron app that streams from wsserver with clients/js/wsserver.js.
//
// The page is served from a custom *standard* scheme, app://bundle/, so the
// renderer's WebSocket handshake carries `Origin: app://bundle` — allow it on
// the server with security.allowed_origins = ["app://bundle"]. The token (if
// the server has one) stays in the main process until the renderer asks.

const { app, BrowserWindow, ipcMain, net, protocol } = require("electron");
const path = require("node:path");
const { pathToFileURL } = require("node:url");

const SERVER_URL = process.env.WSSERVER_URL ?? "ws://127.0.0.1:8765/";
const TOKEN = process.env.WSSERVER_TOKEN ?? "";

// Files the app:// scheme serves: this directory, plus the client module.
const FILES = {
  "/index.html": path.join(__dirname, "index.html"),
  "/renderer.js": path.join(__dirname, "renderer.js"),
  "/wsserver.js": path.join(__dirname, "..", "js", "wsserver.js"),
};

protocol.registerSchemesAsPrivileged([
  { scheme: "app", privileges: { standard: true, secure: true, supportFetchAPI: true } },
]);

app.whenReady().then(() => {
  protocol.handle("app", (request) => {
    const { host, pathname } = new URL(request.url);
    const file = host === "bundle" ? FILES[pathname] : undefined;
    if (!file) return new Response("not found", { status: 404 });
    return net.fetch(pathToFileURL(file).toString());
  });

  ipcMain.handle("wsserver-config", () => ({ url: SERVER_URL, token: TOKEN || undefined }));

  const win = new BrowserWindow({
    width: 900,
    height: 700,
    webPreferences: {
      contextIsolation: true,
      nodeIntegration: false,
      sandbox: true,
      preload: path.join(__dirname, "preload.js"),
    },
  });
  win.loadURL("app://bundle/index.html");
});

app.on("window-all-closed", () => app.quit());
