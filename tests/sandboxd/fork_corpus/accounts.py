import getpass, grp, os, pwd
print(getpass.getuser(), pwd.getpwuid(os.getuid()).pw_dir, grp.getgrgid(os.getgid()).gr_name)
