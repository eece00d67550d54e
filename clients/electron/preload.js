// The only bridge between the page and the main process: the server's URL and
// token, on request. The page itself has no Node.js access.
const { contextBridge, ipcRenderer } = require("electron");

contextBridge.exposeInMainWorld("wsserverConfig", {
  get: () => ipcRenderer.invoke("wsserver-config"),
});
